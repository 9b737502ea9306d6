"""Run pretrain_gpt.py (argv as given) counting the host reads of tensors in every training iteration.

A read is a call of ``Tensor.item``, ``.tolist``, ``.cpu``, ``bool()``, ``float()`` or ``int()`` on a
tensor made by the project's code (callers inside torch are left out: e.g. AdamW's foreach path reads
its ``step`` counters, which torch keeps on the host on purpose, and the fused CUDA kernel reads
none): on a GPU each one waits for the device. Reads are counted between consecutive starts of
``train_step``, so an iteration's count includes its logging. Each rank prints one line
``DEVICE_READS <json>`` with ``per_iteration`` (the reads of every complete iteration, as
``file:line method`` of the caller).
"""
import json
import os
import runpy
import sys
import traceback

import torch

_READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")
_TORCH = os.path.dirname(torch.__file__)
_sites = []
_site_log = []


def _counting(name):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        caller = traceback.extract_stack(limit=2)[0]
        if not caller.filename.startswith(_TORCH):
            _sites.append(f"{os.path.relpath(caller.filename)}:{caller.lineno} {name}")
        return original(self, *args, **kwargs)

    return read


def main():
    import megatron.training.training as training

    train_step = training.train_step

    def marked_train_step(*args, **kwargs):
        _site_log.append(list(_sites))
        _sites.clear()
        return train_step(*args, **kwargs)

    training.train_step = marked_train_step
    for name in _READS:
        setattr(torch.Tensor, name, _counting(name))
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        # _site_log[0]: everything before the first iteration.
        print("DEVICE_READS " + json.dumps({"rank": int(os.environ.get("RANK", "0")),
                                            "per_iteration": _site_log[1:]}), flush=True)


if __name__ == "__main__":
    main()
