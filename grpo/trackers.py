"""Experiment trackers (`report_to`, TRL's name) through accelerate's own tracker classes, on rank 0.

    report_to: none                    # default: metrics.jsonl only (the plots' source of truth)
    report_to: [tensorboard]           # event files in <output_dir>/<run_name>/runs/
    report_to: [wandb, trackio]        # any tracker accelerate knows, if its package is installed

Each rollout step's metrics go to every tracker at step = global_step (optimizer steps, as TRL logs them).
"""

from __future__ import annotations

from pathlib import Path

from grpo.config import ConfigError


def _tracker_classes() -> tuple[dict, set[str]]:
    """(accelerate's tracker classes whose package is installed, by name; every name accelerate knows)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    installed = {str(t) for t in get_available_trackers()}
    return {name: cls for name, cls in LOGGER_TYPE_TO_CLASS.items() if name in installed}, set(LOGGER_TYPE_TO_CLASS)


def check_report_to(report_to: list[str]) -> list[str]:
    """The tracker names to start: "none" -> none, "all" -> every installed one; refuses unknown or missing ones."""
    if report_to in (["none"], []):
        return []
    available, known = _tracker_classes()
    if report_to == ["all"]:
        return sorted(available)
    for name in report_to:
        if name not in known:
            raise ConfigError(
                f"report_to={name!r} is not a tracker accelerate knows; choose from {['none', 'all', *sorted(known)]}"
            )
        if name not in available:
            raise ConfigError(
                f"report_to={name!r} needs its package installed (pip install {name}); installed: "
                f"{sorted(available) or 'none'}"
            )
    return list(report_to)


class Trackers:
    """The started trackers of one run (an empty set on ranks other than 0)."""

    def __init__(self, names: list[str], run_name: str, logging_dir: Path, config: dict, rank: int):
        self.trackers = []
        if rank != 0 or not names:
            return
        available, _ = _tracker_classes()
        for name in names:
            cls = available[name]
            tracker = cls(run_name, logging_dir) if cls.requires_logging_directory else cls(run_name)
            tracker.start()
            tracker.store_init_configuration(_flatten(config))
            self.trackers.append(tracker)

    def log(self, metrics: dict, step: int) -> None:
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self.trackers:
            tracker.log(numbers, step=step)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()


def _flatten(config: dict, prefix: str = "") -> dict:
    """Nested config -> {"lora.r": 16, ...} with scalar values (what trackers' hyperparameter tables take)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat
