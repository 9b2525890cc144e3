"""What the loader supplies when a config leaves it out (GIE's defaults)."""

from __future__ import annotations

DEFAULT_SCORER_WEIGHT = 1.0
DEFAULT_PROFILE_NAME = "default"
DEFAULT_PICKER_TYPE = "max-score-picker"
DEFAULT_PROFILE_HANDLER_TYPE = "single-profile-handler"
DEFAULT_SATURATION_DETECTOR_TYPE = "utilization-detector"
