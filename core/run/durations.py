"""Time left and durations as the step line, `pretrain status` and data preparation print them."""

from __future__ import annotations


def eta_seconds(step: int, total_steps: int, step_time_s: float | None) -> float | None:
    """Seconds left at the current step time; None until a step time is measured."""
    if step >= total_steps or step_time_s is None or step_time_s <= 0:
        return None
    return (total_steps - step) * step_time_s


def format_duration(seconds: float) -> str:
    """3d04h, 2h05m, 4m07s or 12.4s: the two largest units (tenths under a minute, where a
    load or a wait is measured)."""
    if seconds < 59.95:
        return f"{max(seconds, 0.0):.1f}s"
    s = round(seconds)
    days, hours, minutes = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s % 60:02d}s"
    return f"{s}s"
