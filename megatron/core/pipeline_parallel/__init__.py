"""Forward/backward schedules over microbatches."""
from .schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
