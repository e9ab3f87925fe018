"""What of a command's arguments reaches its log: a credential's value never does, however the option is spelled."""

from __future__ import annotations

import os
import subprocess
import sys

from pipelines.core.logfile import redact_argv


def test_redact_argv_hides_a_credential_given_as_option_equals_key_equals_value():
    argv = ["--set=x.aws_secret_access_key=S3KR1T", "--env=HF_TOKEN=t2", "--set=x.num_tokens=8",
            "--set=tracking_uri=http://bob:hunter2@mlflow:5000"]
    assert redact_argv(argv) == ["--set=x.aws_secret_access_key=***", "--env=HF_TOKEN=***", "--set=x.num_tokens=8",
                                 "--set=tracking_uri=http://mlflow:5000"]


def test_the_command_log_records_no_secret_set_with_an_equals_sign(tmp_path):
    # click takes `--set=KEY=VALUE` as `--set KEY=VALUE`; the failed command's log line quotes argv as typed.
    env = {**os.environ, "VITPIPE_LOG_DIR": str(tmp_path / "logs"), "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "evaluate", str(tmp_path / "missing.yaml"),
                           "--set=a.api_key=T0K3N"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    logged = "".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert "--set=a.api_key=***" in logged
    assert "T0K3N" not in logged + proc.stderr
