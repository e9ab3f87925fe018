"""The masked autoencoder as the paper describes it (issue 19 §3, §5)."""

from __future__ import annotations

import pytest
import torch

from vit import MaskedAutoencoder, ViTConfig, VisionTransformer, masking_generator, patchify
from vit import load_checkpoint as vit_load
from vit.mae import random_masking


def encoder(**overrides) -> VisionTransformer:
    base = dict(image_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_dim=64, num_classes=0)
    return VisionTransformer(ViTConfig(**{**base, **overrides}))


def build(**overrides) -> MaskedAutoencoder:
    torch.manual_seed(0)
    return MaskedAutoencoder(encoder(), decoder_dim=16, decoder_depth=1, decoder_heads=2, **overrides).eval()


def images(batch: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ratio, kept", [(0.75, 4), (0.6, 6), (0.9, 2)])
def test_masking_keeps_round_n_times_one_minus_ratio_patches_in_every_image(ratio, kept):
    out = build(mask_ratio=ratio)(images(5), generator=torch.Generator().manual_seed(0))
    assert out.masking.ids_keep.shape == (5, kept)
    assert out.masking.mask.sum(dim=1).tolist() == [16 - kept] * 5
    assert all(len(set(row.tolist())) == kept for row in out.masking.ids_keep)


def test_the_encoder_never_sees_a_masked_patch():
    mae = build()
    patches, grid = mae.patches(images())
    masking = random_masking(3, 16, 0.75, generator=torch.Generator().manual_seed(0))
    scrambled = torch.where(masking.mask.bool().unsqueeze(-1), torch.randn_like(patches) * 100, patches)
    assert not torch.equal(scrambled, patches)
    assert torch.equal(mae.encode(scrambled, grid, masking), mae.encode(patches, grid, masking))


def test_the_same_seed_and_step_draw_the_same_masks_so_a_resumed_run_repeats_them():
    mae = build()
    uninterrupted = [mae(images(), generator=masking_generator(7, step)).masking.mask for step in range(3)]
    resumed_at_step_2 = mae(images(), generator=masking_generator(7, 2)).masking.mask
    assert torch.equal(resumed_at_step_2, uninterrupted[2])


def test_another_seed_or_step_draws_other_masks():
    mask = build()(images(), generator=masking_generator(7, 2)).masking.mask
    other_seed = build()(images(), generator=masking_generator(8, 2)).masking.mask
    other_step = build()(images(), generator=masking_generator(7, 3)).masking.mask
    assert not torch.equal(mask, other_seed)
    assert not torch.equal(mask, other_step)


def test_the_loss_counts_only_masked_patches():
    mae = build()
    patches = patchify(images(), 4)
    masking = random_masking(3, 16, 0.75, generator=torch.Generator().manual_seed(0))
    pred = torch.randn_like(patches)
    off = torch.randn_like(patches) * 10
    visible, masked = 1 - masking.mask.unsqueeze(-1), masking.mask.unsqueeze(-1)
    loss = mae.loss(patches, pred, masking.mask)
    assert torch.equal(mae.loss(patches, pred + off * visible, masking.mask), loss)
    assert not torch.allclose(mae.loss(patches, pred + off * masked, masking.mask), loss)


def test_the_loss_is_the_error_on_per_patch_normalised_pixels():
    mae = build()
    patches = patchify(images(), 4)
    mask = random_masking(3, 16, 0.75, generator=torch.Generator().manual_seed(0)).mask
    normalised = (patches - patches.mean(-1, keepdim=True)) / patches.std(-1, keepdim=True)
    assert mae.loss(patches, normalised, mask).item() == pytest.approx(0.0, abs=1e-5)


def test_images_and_their_patch_sequences_give_the_same_loss():
    mae = build()
    x = images()
    from_images = mae(x, generator=masking_generator(0, 0)).loss
    assert torch.equal(mae(patchify(x, 4), generator=masking_generator(0, 0)).loss, from_images)


def test_a_patch_sequence_grid_with_a_side_that_is_not_positive_is_refused_naming_grid():
    with pytest.raises(ValueError, match=r"grid must be two positive ints \(rows, cols\), got \(-4, -4\)"):
        build()(patchify(images(), 4), grid=(-4, -4))


def test_the_encoder_state_dict_loads_into_a_plain_vit_without_decoder_weights():
    mae = build()
    plain = encoder()
    plain.load_state_dict(mae.encoder.state_dict())  # strict: same keys, same shapes
    assert not any("decoder" in k or "mask_token" in k for k in mae.encoder.state_dict())
    x = images()
    assert torch.equal(plain.eval().forward_features(x), mae.encoder.forward_features(x))


def test_a_few_steps_on_a_tiny_model_reduce_the_loss():
    mae = build().train()
    opt = torch.optim.AdamW(mae.parameters(), lr=3e-3)
    x = images(8)
    losses = []
    for _ in range(20):
        loss = mae(x, generator=masking_generator(0, 0)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0]


def test_the_reconstruction_shows_the_input_where_visible_and_blanks_masked_patches():
    mae = build()
    x = images()
    masked, reconstruction = mae.reconstruct(x, generator=masking_generator(0, 0))
    mask = mae(x, generator=masking_generator(0, 0)).masking.mask.bool()
    assert torch.equal(patchify(reconstruction, 4)[~mask], patchify(x, 4)[~mask])
    assert torch.equal(patchify(masked, 4)[~mask], patchify(x, 4)[~mask])
    assert patchify(masked, 4)[mask].abs().sum() == 0


@pytest.mark.parametrize("ratio", [0.99, 0.01])
def test_a_mask_ratio_leaving_no_masked_or_no_visible_patch_is_one_clear_error(ratio):
    with pytest.raises(ValueError, match=rf"mask_ratio {ratio} on 16 patches keeps \d+"):
        build(mask_ratio=ratio)(images())


def test_a_hybrid_encoder_is_refused_because_its_stem_sees_every_pixel():
    hybrid = VisionTransformer(ViTConfig(image_size=32, patch_size=1, embed_dim=32, depth=1, num_heads=2,
                                         mlp_dim=64, num_classes=0, hybrid={"layers": (1, 1, 1), "width": 8}))
    with pytest.raises(ValueError, match="plain ViT encoder"):
        MaskedAutoencoder(hybrid)


def test_an_mae_checkpoint_is_a_vit_checkpoint_of_the_encoder_with_the_decoder_beside_it(tmp_path):
    from vit.mae import DECODER_FILE, load_mae, save_mae

    mae = build()
    save_mae(mae, tmp_path)
    assert (tmp_path / DECODER_FILE).is_file()
    encoder = vit_load(tmp_path)
    assert type(encoder) is VisionTransformer
    assert all(torch.equal(a, b) for a, b in zip(encoder.state_dict().values(), mae.encoder.state_dict().values()))
    again = load_mae(tmp_path).eval()
    x = images()
    assert torch.equal(again(x, masking_generator(0, 0)).loss, mae(x, masking_generator(0, 0)).loss)


def test_masks_differ_between_ranks_and_micro_batches_of_one_step():
    mae = build()
    masks = {(rank, micro): mae(images(), masking_generator(7, 2, rank, micro)).masking.mask
             for rank in (0, 1) for micro in (0, 1)}
    assert not torch.equal(masks[0, 0], masks[1, 0])
    assert not torch.equal(masks[0, 0], masks[0, 1])


def test_a_corrupt_mae_decoder_file_is_one_value_error_naming_it(tmp_path):
    from vit.mae import DECODER_FILE, load_mae, save_mae

    save_mae(build(), tmp_path)
    (tmp_path / DECODER_FILE).write_bytes(b"truncated")
    with pytest.raises(ValueError, match=DECODER_FILE) as err:
        load_mae(tmp_path)
    assert "\n" not in str(err.value)


def test_an_mae_checkpoint_of_another_shape_is_one_value_error_naming_the_directory(tmp_path):
    from vit.mae import load_mae_weights, save_mae

    save_mae(build(), tmp_path)
    other = MaskedAutoencoder(encoder(), decoder_dim=8, decoder_depth=1, decoder_heads=2)
    with pytest.raises(ValueError, match=str(tmp_path)) as err:
        load_mae_weights(other, tmp_path)
    assert "\n" not in str(err.value)


def test_an_mae_json_that_does_not_fit_the_options_is_one_value_error_naming_it(tmp_path):
    from vit.mae import MAE_CONFIG_FILE, load_mae, save_mae

    save_mae(build(), tmp_path)
    (tmp_path / MAE_CONFIG_FILE).write_text('{"decoder_width": 16}')
    with pytest.raises(ValueError, match=MAE_CONFIG_FILE):
        load_mae(tmp_path)
