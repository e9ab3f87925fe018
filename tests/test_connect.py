"""pipelines.core.cluster.connect: the one way to join Ray (a stand-in `ray` module; no cluster started)."""

from __future__ import annotations

import sys
import types

import pytest

from pipelines.core.cluster import connect


@pytest.fixture
def fake_ray(monkeypatch):
    calls: list[str | None] = []
    state = {"up": False}

    def init(address=None):
        calls.append(address)
        state["up"] = True

    module = types.SimpleNamespace(is_initialized=lambda: state["up"], init=init, calls=calls, state=state)
    monkeypatch.setitem(sys.modules, "ray", module)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return module


def test_connect_joins_the_given_address_once(fake_ray):
    connect("ray://head:10001")
    connect("ray://other:10001")  # already connected: nothing happens
    assert fake_ray.calls == ["ray://head:10001"]


def test_connect_without_an_address_uses_ray_address(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    connect()
    assert fake_ray.calls == ["head:6379"]


def test_connect_without_any_address_starts_a_local_ray(fake_ray):
    connect()
    assert fake_ray.calls == [None]


def test_connect_is_a_no_op_when_ray_is_up(fake_ray):
    fake_ray.state["up"] = True
    connect("head:6379")
    assert fake_ray.calls == []
