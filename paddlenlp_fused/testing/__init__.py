"""Test and benchmark support: numerics (relative error and bounds), GPU tensor providers, and a
runner for multi-process (gloo) test bodies. Not imported by the library itself."""
