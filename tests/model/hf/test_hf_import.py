"""The HF importer without running a model: file formats, config mapping, and user errors.

Sharded and bf16 checkpoints read like single float32 files; hub-style configs (1-based Kimi
layer lists, Bailing's overwritten ``head_dim``) map to the right layer pattern; configs survive
``to_dict`` and the checkpoint TOML; and every broken checkpoint — unsupported ``model_type``, a
missing, extra or misshapen tensor, an unreadable file, a missing ``config.json``, a directory that
is not an orbax checkpoint — makes ``prfaas`` exit with status 2 and a one-line message.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_fixtures import FAMILIES, make_tiny
from hf_parity import assert_same_params
from safetensors.numpy import load_file, save_file

from prfaas_jax.cli import main
from prfaas_jax.config import LayerKind, MlpKind, config_from_dict, load_model_config
from prfaas_jax.model import state_nbytes
from prfaas_jax.model.checkpoint import config_to_toml
from prfaas_jax.model.hf import hf_config, load_hf

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # a KDA layer of the default Kimi fixture


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return make_tiny("kimi_linear", tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    return load_hf(kimi_dir)


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite_tensors(directory, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def test_sharded_checkpoint_reads_like_one_file(kimi_dir, kimi, tmp_path):
    sharded = _copy(kimi_dir, tmp_path)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for index, part in enumerate((names[::2], names[1::2])):
        shard = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / shard)
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg, params = load_hf(sharded, name=kimi[0].name)
    assert cfg == kimi[0]
    assert_same_params(params, kimi[1])


def test_bf16_checkpoint_gives_a_bf16_model(kimi_dir, kimi, tmp_path):
    bf16 = _copy(kimi_dir, tmp_path)
    _rewrite_tensors(
        bf16, lambda t: t.update({n: a.astype(ml_dtypes.bfloat16) for n, a in t.items()})
    )
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    cfg, params = load_hf(bf16)
    assert cfg.dtype == "bfloat16" and params["embed"].dtype == jnp.bfloat16
    # Routers, decay rates and selection biases stay float32, as init_params keeps them.
    assert params["layers"][1]["mlp"]["router"].dtype == jnp.float32
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(kimi[1]), strict=True):
        expected = np.asarray(ref).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(got, np.float32), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_configs_round_trip(family, tmp_path):
    cfg = hf_config(make_tiny(family, tmp_path / family))
    assert cfg.max_len_fixed  # the checkpoint's context length is what its weights know
    assert config_from_dict(cfg.to_dict()) == cfg
    (tmp_path / "config.toml").write_text(config_to_toml(cfg))
    assert load_model_config(tmp_path) == cfg


def _write_config(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_kimi_hub_config_matches_the_48b_preset(tmp_path):
    # The layout of moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (1-based layer lists).
    full = [4, 8, 12, 16, 20, 24, 27]
    hub = {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "num_hidden_layers": 27,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "model_max_length": 1048576,
        "linear_attn_config": {
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, 28) if i not in full],
            "head_dim": 128,
            "num_heads": 32,
            "short_conv_kernel_size": 4,
        },
    }
    cfg = hf_config(_write_config(tmp_path, hub))
    preset = load_model_config("kimi-linear-48b")
    assert cfg.layers == preset.layers
    assert [i for i, k in enumerate(cfg.layers) if k is LayerKind.MLA] == [i - 1 for i in full]
    assert cfg.mlps == preset.mlps and cfg.mlps[0] is MlpKind.DENSE
    assert (cfg.linear.head_dim, cfg.mla.kv_lora_rank, cfg.dtype) == (128, 512, "bfloat16")
    assert state_nbytes(cfg, 32768) == state_nbytes(preset, 32768)


def test_bailing_hub_head_dim_is_the_kda_head_dim(tmp_path):
    # Hub configs carry the KDA head dim as head_dim; HF-saved ones add linear_head_dim.
    hub = {"model_type": "bailing_hybrid", "num_hidden_layers": 6, "head_dim": 96}
    cfg = hf_config(_write_config(tmp_path, hub))
    assert cfg.linear.head_dim == 96 and cfg.mla.qk_rope_head_dim == 64
    assert cfg.layers == (LayerKind.KDA,) * 5 + (LayerKind.MLA,)


# --- user errors ----------------------------------------------------------------------------


def _fails(capsys, argv, message):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert message in err, err


def _both_commands_fail(capsys, directory, tmp_path, message):
    _fails(capsys, ["convert-hf", str(directory), str(tmp_path / "out")], message)
    _fails(capsys, ["generate", "--hf", str(directory), "--prompt-ids", "1,2"], message)


def test_unsupported_model_type(capsys, kimi_dir, tmp_path):
    broken = _copy(kimi_dir, tmp_path)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    _both_commands_fail(capsys, broken, tmp_path, "model_type 'llama' is not supported")


def test_missing_tensor(capsys, kimi_dir, tmp_path):
    broken = _copy(kimi_dir, tmp_path)
    _rewrite_tensors(broken, lambda t: t.pop(Q_PROJ))
    _both_commands_fail(capsys, broken, tmp_path, f"missing tensor '{Q_PROJ}'")


def test_wrong_shape_names_the_tensor_and_both_shapes(capsys, kimi_dir, tmp_path):
    broken = _copy(kimi_dir, tmp_path)
    _rewrite_tensors(broken, lambda t: t.update({Q_PROJ: t[Q_PROJ][:, :32].copy()}))
    _both_commands_fail(
        capsys, broken, tmp_path, f"tensor '{Q_PROJ}' has shape [64, 32], expected [64, 64]"
    )


def test_unexpected_tensor(capsys, kimi_dir, tmp_path):
    broken = _copy(kimi_dir, tmp_path)
    extra = "model.layers.0.self_attn.surprise.weight"
    _rewrite_tensors(broken, lambda t: t.update({extra: np.zeros((2, 2), np.float32)}))
    _both_commands_fail(capsys, broken, tmp_path, f"unexpected tensor(s) in {broken}: {extra}")


def test_unreadable_files(capsys, kimi_dir, tmp_path):
    broken = _copy(kimi_dir, tmp_path)
    (broken / "model.safetensors").write_bytes(b"\x00" * 3)
    _both_commands_fail(capsys, broken, tmp_path, "is not a safetensors file")
    (broken / "config.json").write_text("{not json")
    _both_commands_fail(capsys, broken, tmp_path, "cannot read")
    (broken / "config.json").unlink()
    _both_commands_fail(capsys, broken, tmp_path, "no config.json")
    _both_commands_fail(capsys, tmp_path / "nowhere", tmp_path, "not a checkpoint directory")


def test_not_an_orbax_checkpoint(capsys, kimi_dir, tmp_path):
    _fails(
        capsys,
        ["generate", "--checkpoint", str(kimi_dir), "--prompt-ids", "1"],
        "is not a checkpoint",
    )


def test_convert_refuses_to_overwrite(capsys, kimi_dir, tmp_path):
    out = tmp_path / "out"
    assert main(["convert-hf", str(kimi_dir), str(out)]) == 0
    capsys.readouterr()
    _fails(capsys, ["convert-hf", str(kimi_dir), str(out)], "already holds a checkpoint")
    assert main(["convert-hf", str(kimi_dir), str(out), "--force"]) == 0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"model_type": "qwen3_next", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_type 'yarn'",
        ),
        ({"model_type": "kimi_linear", "attention_bias": True}, "attention_bias"),
        ({"model_type": "kimi_linear", "mla_use_nope": False}, "mla_use_nope"),
        ({"model_type": "mimo_v2_flash", "head_dim": 16}, "odd number of rotary dims"),
        ({"model_type": "minimax", "num_hidden_layers": "4"}, "must be an integer"),
    ],
)
def test_unsupported_configs(capsys, tmp_path, raw, message):
    directory = tmp_path / "hf"
    directory.mkdir()
    _write_config(directory, raw)
    _fails(capsys, ["convert-hf", str(directory), str(tmp_path / "out")], message)
