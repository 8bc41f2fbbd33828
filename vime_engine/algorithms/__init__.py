"""Pure tensor math of RL post-training: advantages and the table of estimators, losses, micro-batch packing (no I/O,
no state). The package imports nothing itself, so vime_engine/config/ reads `estimators.py` without loading torch;
import from the modules."""
