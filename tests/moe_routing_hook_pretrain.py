"""Test helper (not a test): pretrain_gpt.py with every MoE router's routing wrapped to record what it chose.

Run like pretrain_gpt.py (same flags). Each router's ``routing(logits)`` is wrapped on the instance, so the
record is made independently of the routing-stats recorder the telemetry uses: per call, the layer number
(1-based, from the module name and the stage's layer offset), whether autograd was recording, ``before``: the
tokens per global expert recomputed here as the top-k of the logits (the router's choice for a softmax or
sigmoid score without expert bias or group limits, before any capacity dropping), and ``after``: the returned
``routing_map.sum(0)`` (after dropping). At exit each rank writes its calls, in order, to
``$MOE_ROUTING_HOOK_DIR/rank{RANK}.json``. Production code has no such hook.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402

CALLS = []


def _hooked_model_provider(*args, **kwargs):
    from megatron.core.transformer.transformer_block import get_transformer_layer_offset

    model = pretrain_gpt.model_provider(*args, **kwargs)
    offset = get_transformer_layer_offset(model.config, kwargs.get("vp_stage"))
    for name, module in model.named_modules():
        if not name.endswith(".mlp.router"):
            continue
        layer_number = offset + int(name.split(".layers.")[1].split(".")[0]) + 1

        def routing(logits, original=module.routing, layer_number=layer_number, topk=module.topk):
            probs, routing_map = original(logits)
            experts = routing_map.shape[-1]
            chosen = torch.topk(logits.reshape(-1, experts), topk, dim=-1).indices
            CALLS.append({"layer": layer_number, "grad": torch.is_grad_enabled(),
                          "before": torch.bincount(chosen.flatten(), minlength=experts).tolist(),
                          "after": routing_map.sum(dim=0).tolist()})
            return probs, routing_map

        module.routing = routing
    return model


def main():
    try:
        pretrain_gpt.run_reporting_user_errors(
            pretrain_gpt.pretrain, pretrain_gpt.train_valid_test_datasets_provider, _hooked_model_provider,
            pretrain_gpt.forward_step, extra_args_provider=pretrain_gpt.require_inputs,
            args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        out = Path(os.environ["MOE_ROUTING_HOOK_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
        out.write_text(json.dumps(CALLS))


if __name__ == "__main__":
    main()
