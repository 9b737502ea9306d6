"""Span groups: named switches for span granularity, with presets and a spec parser."""
from __future__ import annotations

from typing import ClassVar, Dict, FrozenSet, Tuple

__all__ = ["SpanGroup"]


class SpanGroup:
    """The base span groups shared by every framework instrumented with this layer.

    A group is a plain lowercase ``str`` (``SpanGroup.STEP == "step"``) so that the hot-path check
    ``group in enabled`` is one hash lookup of an interned string. Subclasses add groups by declaring
    more upper-case ``str`` class attributes and extend presets by overriding ``PRESETS``.

    Spec grammar (``resolve``): comma-separated preset and/or group names, case- and
    whitespace-insensitive, unioned; an empty spec enables nothing.
    """

    JOB = "job"
    CHECKPOINT = "checkpoint"
    EVALUATE = "evaluate"
    MODEL_INIT = "model_init"
    LOAD_CHECKPOINT = "load_checkpoint"
    STEP = "step"
    FORWARD_BACKWARD = "forward_backward"
    OPTIMIZER = "optimizer"

    PRESETS: ClassVar[Dict[str, Tuple[str, ...]]] = {
        "default": ("job", "checkpoint", "evaluate"),
        "per_step": (
            "job", "checkpoint", "evaluate",
            "model_init", "load_checkpoint", "step", "forward_backward", "optimizer",
        ),
    }
    # Presets that always mean "every group of this class".
    ALL_PRESETS: ClassVar[Tuple[str, ...]] = ("all", "full", "profiling")

    _groups_cache: ClassVar[Dict[type, FrozenSet[str]]] = {}

    @classmethod
    def groups(cls) -> FrozenSet[str]:
        """Every group name this class (and its bases) declares."""
        cached = SpanGroup._groups_cache.get(cls)
        if cached is None:
            names = set()
            for klass in cls.__mro__:
                for attr, value in vars(klass).items():
                    if attr.isupper() and isinstance(value, str):
                        names.add(value)
            cached = frozenset(names)
            SpanGroup._groups_cache[cls] = cached
        return cached

    @classmethod
    def presets(cls) -> Dict[str, FrozenSet[str]]:
        """Preset name -> groups, including ``all`` and its aliases ``full``/``profiling``."""
        out = {name: frozenset(members) for name, members in cls.PRESETS.items()}
        for name in cls.ALL_PRESETS:
            out[name] = cls.groups()
        return out

    @classmethod
    def valid_names(cls) -> Tuple[str, ...]:
        """Sorted presets followed by sorted group names: the choices listed in error messages."""
        return tuple(sorted(cls.presets())) + tuple(sorted(cls.groups()))

    @classmethod
    def resolve(cls, spec: str | None, source: str = "span group spec") -> FrozenSet[str]:
        """Turn a spec like ``"default, Microbatch"`` into the frozenset of enabled group names.

        ``source`` names where the spec came from (an environment variable or CLI flag) for errors.
        Raises ``ValueError`` naming ``source``, the bad token and the valid choices on an unknown name.
        """
        if spec is None:
            return frozenset()
        if not isinstance(spec, str):
            raise ValueError(f"{source}: expected a comma-separated string, got {type(spec).__name__}")
        presets = cls.presets()
        groups = cls.groups()
        enabled = set()
        for raw in spec.split(","):
            token = raw.strip().lower()
            if not token:
                continue
            if token in presets:
                enabled.update(presets[token])
            elif token in groups:
                enabled.add(token)
            else:
                raise ValueError(
                    f"{source}: Unknown span group or preset: {raw.strip()!r}. Valid options: "
                    + ", ".join(cls.valid_names())
                )
        return frozenset(enabled)
