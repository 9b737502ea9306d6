"""tools/checkpoint/legacy_checkpoint.py: TP shards and PP stages (mp_rank_XX_YYY) merge into one state dict and split back;
QKV/SwiGLU layouts convert to Hugging Face and back exactly."""
import argparse

import pytest
import torch

from pretrain_utils import load_checkpoint_tool

_load_tool = load_checkpoint_tool


legacy = _load_tool("legacy_checkpoint")
conversion = _load_tool("hf_conversion")

H, HEADS, GROUPS, D, FFN, V_PAD, LAYERS = 16, 4, 2, 4, 24, 64, 4


def _args(**overrides):
    values = dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, group_query_attention=True,
                  num_query_groups=GROUPS, kv_channels=D, ffn_hidden_size=FFN, swiglu=True,
                  position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=True,
                  untie_embeddings_and_output_weights=False, max_position_embeddings=32, padded_vocab_size=V_PAD)
    values.update(overrides)
    return argparse.Namespace(**values)


def _full_state(args, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    groups = args.num_query_groups if args.group_query_attention else HEADS
    qkv = (HEADS + 2 * groups) * D
    state = {"embedding.word_embeddings.weight": rand(V_PAD, H)}
    for n in range(args.num_layers):
        p = f"decoder.layers.{n}."
        state.update({p + "input_layernorm.weight": rand(H), p + "self_attention.linear_qkv.weight": rand(qkv, H),
                      p + "self_attention.linear_qkv.bias": rand(qkv), p + "self_attention.linear_qkv._extra_state": None,
                      p + "self_attention.linear_proj.weight": rand(H, HEADS * D),
                      p + "self_attention.linear_proj.bias": rand(H), p + "pre_mlp_layernorm.weight": rand(H),
                      p + "mlp.linear_fc1.weight": rand(2 * FFN, H), p + "mlp.linear_fc1.bias": rand(2 * FFN),
                      p + "mlp.linear_fc2.weight": rand(H, FFN), p + "mlp.linear_fc2.bias": rand(H)})
    state["decoder.final_layernorm.weight"] = rand(H)
    if args.untie_embeddings_and_output_weights:
        state["output_layer.weight"] = rand(V_PAD, H)
    state["output_layer._extra_state"] = None
    return state


def _write(root, args, state, tp, pp):
    """A legacy checkpoint laid out as pretrain_gpt.py writes it for TP=tp, PP=pp (local layer numbers)."""
    per_stage = args.num_layers // pp
    tied = not args.untie_embeddings_and_output_weights
    for stage in range(pp):
        stage_state = {}
        for key, value in state.items():
            if key.startswith("decoder.layers."):
                number = int(key.split(".")[2])
                if number // per_stage != stage:
                    continue
                key = key.replace(f"decoder.layers.{number}.", f"decoder.layers.{number - stage * per_stage}.")
            elif key.startswith("embedding.") and stage != 0:
                continue
            elif (key.startswith("output_layer.") or key.startswith("decoder.final_layernorm")) and stage != pp - 1:
                continue
            stage_state[key] = value
        if tied and pp > 1 and stage == pp - 1:
            stage_state["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
        for rank, shard in enumerate(legacy.split_tp(stage_state, tp, swiglu=args.swiglu)):
            name = f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")
            folder = root / "iter_0000005" / name
            folder.mkdir(parents=True)
            torch.save({"args": args, "iteration": 5, "model": shard}, folder / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("5")


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        assert (a[key] is None and b[key] is None) or torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("tp,pp,untie", [(1, 1, False), (2, 1, False), (2, 2, False), (1, 4, True), (2, 2, True)])
def test_tp_and_pp_shards_merge_to_the_full_state(tmp_path, tp, pp, untie):
    args = _args(untie_embeddings_and_output_weights=untie)
    state = _full_state(args)
    _write(tmp_path, args, state, tp, pp)
    merged, saved_args, info = legacy.read_checkpoint(str(tmp_path))
    assert (info["tp"], info["pp"]) == (tp, pp)
    _assert_same(merged, state)


def test_swiglu_shard_holds_its_gate_and_up_rows():
    args = _args()
    state = _full_state(args)
    shards = legacy.split_tp(state, 2, swiglu=True)
    fc1 = state["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1[:FFN], fc1[FFN:]
    assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[FFN // 2:], up[FFN // 2:]]))
    # QKV shards hold whole query groups: rank 1 has group 1's [q q k v] rows.
    qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"], qkv[qkv.size(0) // 2:])


def test_incomplete_checkpoint_is_named(tmp_path):
    args = _args()
    _write(tmp_path, args, _full_state(args), 2, 2)
    (tmp_path / "iter_0000005" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    (tmp_path / "iter_0000005" / "mp_rank_01_001").rmdir()
    with pytest.raises(legacy.CheckpointLayoutError, match=r"missing rank folders.*\(1, 1\)"):
        legacy.read_checkpoint(str(tmp_path))
    with pytest.raises(legacy.CheckpointLayoutError, match="latest_checkpointed_iteration.txt"):
        legacy.read_checkpoint(str(tmp_path / "nothing"))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_mapping_round_trips(arch):
    if arch == "llama":
        args = _args(untie_embeddings_and_output_weights=True)
    else:
        args = _args(group_query_attention=False, swiglu=False, kv_channels=H // HEADS, ffn_hidden_size=FFN,
                     position_embedding_type="learned_absolute", normalization="LayerNorm")
    state = _full_state(args)
    if arch == "gpt2":
        state = {k: v for k, v in state.items() if ".linear_fc1." not in k}
        generator = torch.Generator().manual_seed(5)
        for n in range(LAYERS):
            state[f"decoder.layers.{n}.mlp.linear_fc1.weight"] = torch.randn(FFN, H, generator=generator)
            state[f"decoder.layers.{n}.mlp.linear_fc1.bias"] = torch.randn(FFN, generator=generator)
            for norm in ("input_layernorm", "pre_mlp_layernorm"):
                state[f"decoder.layers.{n}.{norm}.bias"] = torch.randn(H, generator=generator)
        state["decoder.final_layernorm.bias"] = torch.randn(H, generator=generator)
        state["embedding.position_embeddings.weight"] = torch.randn(32, H, generator=generator)
    hf = conversion.megatron_to_hf(state, args, vocab_size=50)
    back = conversion.hf_to_megatron(hf, args, V_PAD)
    expected = dict(state)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in expected:
            expected[key] = torch.cat([state[key][:50], torch.zeros(V_PAD - 50, H)])
    for n in range(LAYERS):
        for linear in ("self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            expected.setdefault(f"decoder.layers.{n}.{linear}._extra_state", None)
    _assert_same(back, expected)
    if arch == "llama":  # q of query group 1 = rows of heads 2, 3 in HF's q_proj
        qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"].reshape(GROUPS, HEADS // GROUPS + 2, D, H)
        assert torch.equal(hf["model.layers.0.self_attn.q_proj.weight"][2 * D:4 * D], qkv[1, :2].reshape(2 * D, H))
        assert torch.equal(hf["model.layers.0.self_attn.k_proj.weight"][D:2 * D], qkv[1, 2])


def test_unsupported_architectures_are_named():
    with pytest.raises(conversion.UnsupportedModelError, match="--qk-layernorm"):
        conversion.architecture_of(_args(qk_layernorm=True))
    with pytest.raises(conversion.UnsupportedModelError, match="neither GPT-2"):
        conversion.architecture_of(_args(normalization="LayerNorm"))
    with pytest.raises(conversion.UnsupportedModelError, match="grouped-query"):
        conversion.architecture_of(_args(swiglu=False, position_embedding_type="learned_absolute",
                                         normalization="LayerNorm"))


def test_tools_report_bad_folders_in_one_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    export_hf = _load_tool("export_hf")
    import_hf = _load_tool("import_hf")
    assert export_hf.main(["--load", str(tmp_path), "--save", str(tmp_path / "hf")]) == 1
    assert import_hf.main(["--load", str(tmp_path), "--save", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: --load {tmp_path}: no latest_checkpointed_iteration.txt (not a checkpoint folder?)",
                   f"error: --load {tmp_path}: no config.json (not a Hugging Face model folder)"]
