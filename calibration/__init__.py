"""Calibration: measure a device, fit its thresholds, keep them as a versioned profile.

``store`` reads and writes profiles and finds the one for a device; the resolver asks it
before any backend default.
"""
