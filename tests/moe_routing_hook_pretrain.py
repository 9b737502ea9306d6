"""Test helper (not a test): pretrain_gpt.py with a forward hook on every MoE router that records its routing map.

Run like pretrain_gpt.py (same flags). Each router's forward output ``(probs, routing_map)`` is read by a
PyTorch forward hook, independently of the routing-stats recorder the telemetry uses: per call, the layer
number (1-based, from the module name and the stage's layer offset), whether autograd was recording, and
``routing_map.sum(0)`` (tokens per global expert after any capacity dropping). At exit each rank writes its
calls, in order, to ``$MOE_ROUTING_HOOK_DIR/rank{RANK}.json``. Production code has no such hook.
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

        def hook(module, inputs, output, layer_number=layer_number):
            routing_map = output[1]
            CALLS.append({"layer": layer_number, "grad": torch.is_grad_enabled(),
                          "counts": routing_map.sum(dim=0).tolist()})

        module.register_forward_hook(hook)
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
