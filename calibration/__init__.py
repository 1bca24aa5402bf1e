"""Calibration: measure a device, fit its thresholds, keep them as a versioned profile.

``kvswap calibrate`` (:mod:`.cli_calibrate`) runs the sweep, the fit and the store; the
resolver reads the profiles it writes through :mod:`kvswap.resolution.profiles`, and never imports this
package. ``kvswap bench`` (:mod:`.cli_bench`) holds the resolved route against every
candidate and a peer policy.
"""
