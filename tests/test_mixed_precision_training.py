"""End-to-end --bf16 and --fp16 training (2 gloo ranks, CPU): loss falls, fp32 main params are kept, and
fp16 dynamic loss scaling skips overflowing steps, halves the scale and grows it back (Megatron's rules)."""
import re

import pytest
import torch

from pretrain_utils import log_records, preprocess_shakespeare, run_pretrain, sentencepiece_flags

# The 8k SentencePiece vocabulary keeps the fp16 output layer affordable on CPU.
COMMON = ["--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "1000"]


@pytest.fixture(scope="module")
def sp_prefix(shared_data, tmp_path_factory):
    return preprocess_shakespeare(shared_data, tmp_path_factory.mktemp("sp_data"), sentencepiece=True)


def _checkpoint(tmp_path, iteration):
    return torch.load(tmp_path / "ckpt" / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt",
                      map_location="cpu", weights_only=False)


def _mean(values):
    return sum(values) / len(values)


def _assert_fp32_main_params(state, dtype):
    """Model weights in ``dtype``; the optimizer's fp32 main copies round to them but keep more bits."""
    weights = [v for k, v in state["model"].items() if isinstance(v, torch.Tensor) and v.is_floating_point()
               and not k.endswith("_extra_state")]
    assert weights and all(w.dtype == dtype for w in weights)
    mains = [p for group in state["optimizer"]["fp32_from_fp16_params"] for p in group]
    assert mains and all(p.dtype == torch.float32 for p in mains)
    assert sum(p.numel() for p in mains) == sum(w.numel() for w in weights)
    assert any(not torch.equal(p, p.to(dtype).float()) for p in mains), "main params hold only low-precision values"


def _assert_memory_report(out, bytes_per_param):
    (line,) = [line for line in out.splitlines() if line.startswith("Theoretical memory footprints:")]
    count = int(re.search(r"number of parameters on \(tensor, pipeline\) model parallel rank \(0, 0\): (\d+)",
                          out).group(1))
    reported = float(re.fullmatch(r"Theoretical memory footprints: weight and optimizer=(\d+\.\d\d) MB, "
                                  r"activation=\d+\.\d\d MB, total=\d+\.\d\d MB", line).group(1))
    assert reported == pytest.approx(bytes_per_param * count / 2 ** 20, abs=0.006)


@pytest.mark.timeout(400)
def test_bf16_trains_30_iterations_with_fp32_main_params(shared_data, sp_prefix, tmp_path):
    out = run_pretrain(2, [*COMMON, *sentencepiece_flags(shared_data), "--bf16", "--train-iters", "30",
                           "--save", str(tmp_path / "ckpt"), "--ckpt-format", "torch", "--save-interval", "1000"],
                       shared_data, sp_prefix, tmp_path)
    records = log_records(out)
    assert sorted(records) == list(range(1, 31))
    assert all(r["loss_scale"] == 1.0 and r["skipped"] == 0 and r["nan"] == 0 for r in records.values())
    losses = [records[i]["loss"] for i in range(1, 31)]
    assert _mean(losses[-5:]) < _mean(losses[:5]) - 0.2, losses
    _assert_memory_report(out, 18)  # 2 (bf16) + 4 (fp32 grads) + 4 (fp32 main) + 8 (Adam)
    _assert_fp32_main_params(_checkpoint(tmp_path, 30), torch.bfloat16)


def _expected_scales(skipped, initial, window):
    """Megatron's DynamicGradScaler with --hysteresis 1: halve on every overflow, double after
    ``window`` consecutive clean steps."""
    scale, clean, scales = initial, 0, []
    for was_skipped in skipped:
        if was_skipped:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == window:
                scale, clean = scale * 2, 0
        scales.append(scale)
    return scales


@pytest.mark.timeout(400)
def test_fp16_overflow_skips_halves_and_proceeds(shared_data, sp_prefix, tmp_path):
    initial, window, iters = 2.0 ** 22, 8, 40  # 2^22 overflows this model's fp16 grads; 2^17 does not
    out = run_pretrain(2, [*COMMON, *sentencepiece_flags(shared_data), "--fp16", "--train-iters", str(iters),
                           "--initial-loss-scale", str(int(initial)), "--hysteresis", "1",
                           "--loss-scale-window", str(window), "--save", str(tmp_path / "ckpt"), "--ckpt-format", "torch",
                           "--save-interval", "1000"],
                       shared_data, sp_prefix, tmp_path)
    records = [log_records(out)[i] for i in range(1, iters + 1)]
    skipped = [r["skipped"] == 1 for r in records]
    first_clean = skipped.index(False)
    assert first_clean >= 3 and all(skipped[:first_clean]), skipped
    # A skipped step prints no loss and no grad norm (nothing was applied), and its loss was finite.
    assert all(r["loss"] is None and r["grad_norm"] is None and r["nan"] == 0 for r in records[:first_clean])
    assert [r["loss_scale"] for r in records] == _expected_scales(skipped, initial, window)
    applied = [r["loss"] for r in records if r["skipped"] == 0]
    assert len(applied) >= 30 and all(loss is not None for loss in applied)
    assert _mean(applied[-5:]) < _mean(applied[:5]) - 0.2, applied
    _assert_memory_report(out, 16)  # fp16 grads: 2 + 2 + 4 + 8
    state = _checkpoint(tmp_path, iters)
    _assert_fp32_main_params(state, torch.float16)
    assert state["optimizer"]["grad_scaler"]["scale"].item() == records[-1]["loss_scale"]
