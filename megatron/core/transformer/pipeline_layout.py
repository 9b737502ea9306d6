"""How many transformer layers each pipeline stage (and virtual stage) holds, and where each block starts.

Facts from Megatron-LM (``get_num_layers_to_build`` / ``get_transformer_layer_offset`` and the
TransformerConfig checks), computed here as one table so that the per-stage count and the global
offset can never disagree:

- even split: every stage holds ``num_layers / pp`` layers;
- uneven split (``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``): the
  given stages hold the given counts and the remaining layers are spread evenly over the other
  ("middle") stages;
- ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``: the embedding
  (first stage) and the loss (last stage) each count as one layer in the split, so those stages build
  one transformer layer less;
- virtual stages (interleaving, vp chunks per stage): each stage's count is divided by vp, and the
  model's blocks are ordered chunk-major: block ``v * pp + p`` is chunk v of stage p (16 layers,
  pp=4, vp=2: stage 0 holds layers 1-2 and 9-10).

Layer numbers (``TransformerLayer.layer_number``) are global and 1-based; the state-dict keys of
the legacy checkpoint format use the local index within the stage (``decoder.layers.<i>``).
"""
from typing import List, Optional


def pipeline_layer_counts(num_layers: int, pipeline_model_parallel_size: int,
                          virtual_pipeline_model_parallel_size: Optional[int] = None,
                          num_layers_in_first_pipeline_stage: Optional[int] = None,
                          num_layers_in_last_pipeline_stage: Optional[int] = None,
                          account_for_embedding_in_pipeline_split: bool = False,
                          account_for_loss_in_pipeline_split: bool = False) -> List[List[int]]:
    """Transformer layers of every (stage, virtual stage): ``counts[p][v]``.

    Returns a pp x vp table (vp = 1 without interleaving) whose entries sum to ``num_layers``.

    Raises:
        ValueError: the split does not add up (names the numbers): layers not divisible by the
            stages (or virtual stages), first + last stage layers exceeding the total, uneven split
            combined with account-for-embedding/loss, a stage left without room for its embedding
            or loss, or a negative count.
    """
    pp = pipeline_model_parallel_size
    vp = virtual_pipeline_model_parallel_size or 1
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    if pp < 1 or vp < 1:
        raise ValueError(f"pipeline_model_parallel_size ({pp}) and virtual_pipeline_model_parallel_size ({vp}) "
                         "must be >= 1")
    uneven = first is not None or last is not None
    accounted = account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split
    if uneven and accounted:
        raise ValueError("num_layers_in_first/last_pipeline_stage (uneven split) cannot be combined with "
                         "account_for_embedding/loss_in_pipeline_split")
    if uneven and pp == 1:
        raise ValueError(f"num_layers_in_first/last_pipeline_stage ({first}/{last}) need "
                         f"pipeline_model_parallel_size > 1 (got {pp})")
    if uneven:
        for name, value in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
            if value is not None and value < 0:
                raise ValueError(f"{name} ({value}) must be >= 0")
        given = (first or 0) + (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = num_layers - given
        if middle_layers < 0:
            raise ValueError(f"num_layers_in_first_pipeline_stage ({first}) + num_layers_in_last_pipeline_stage "
                             f"({last}) = {given} exceeds num_layers ({num_layers})")
        if middle_stages == 0 and middle_layers != 0:
            raise ValueError(f"num_layers_in_first_pipeline_stage ({first}) + num_layers_in_last_pipeline_stage "
                             f"({last}) = {given} must equal num_layers ({num_layers}) with "
                             f"pipeline_model_parallel_size {pp} (no middle stages)")
        if middle_stages > 0 and middle_layers % middle_stages != 0:
            raise ValueError(f"the {middle_layers} layers left for the {middle_stages} middle pipeline stage(s) "
                             f"(num_layers {num_layers} - first {first or 0} - last {last or 0}) are not divisible "
                             f"by {middle_stages}")
        per_middle = middle_layers // middle_stages if middle_stages else 0
        per_stage = [per_middle] * pp
        if first is not None:
            per_stage[0] = first
        if last is not None:
            per_stage[-1] = last
    else:
        total = num_layers + int(account_for_embedding_in_pipeline_split) + int(account_for_loss_in_pipeline_split)
        if total % pp != 0:
            what = f"num_layers ({num_layers})" if not accounted else (
                f"num_layers ({num_layers}) + embedding ({int(account_for_embedding_in_pipeline_split)}) + "
                f"loss ({int(account_for_loss_in_pipeline_split)}) = {total}")
            raise ValueError(f"{what} must be divisible by pipeline_model_parallel_size ({pp})")
        per_stage = [total // pp] * pp
    for p, count in enumerate(per_stage):
        if count % vp != 0:
            raise ValueError(f"pipeline stage {p} has {count} layers, which is not divisible by "
                             f"virtual_pipeline_model_parallel_size ({vp})")
    counts = [[count // vp] * vp for count in per_stage]
    # The embedding / loss take one "layer" of the first / last block (Megatron's accounting).
    if account_for_embedding_in_pipeline_split:
        counts[0][0] -= 1
    if account_for_loss_in_pipeline_split:
        counts[-1][-1] -= 1
    for p in range(pp):
        for v in range(vp):
            if counts[p][v] < 0:
                raise ValueError(f"pipeline stage {p} (virtual stage {v}) is left with {counts[p][v]} transformer "
                                 f"layers after accounting for the embedding/loss; use more layers or fewer stages")
    return counts


def pipeline_layer_offset(counts: List[List[int]], pipeline_rank: int, vp_stage: int = 0) -> int:
    """0-based global index of the first layer of chunk ``vp_stage`` on stage ``pipeline_rank``.

    Blocks are ordered chunk-major (all stages' chunk 0, then all stages' chunk 1, ...), so the
    offset is the sum of the counts of the blocks before ``(vp_stage, pipeline_rank)``.
    """
    pp = len(counts)
    offset = 0
    for v in range(vp_stage + 1):
        for p in range(pp):
            if v == vp_stage and p == pipeline_rank:
                return offset
            offset += counts[p][v]
    raise ValueError(f"pipeline rank {pipeline_rank} / virtual stage {vp_stage} is outside the "
                     f"{pp} x {len(counts[0])} layout")
