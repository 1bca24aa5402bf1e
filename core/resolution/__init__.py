"""Choosing a route once: calibration lookup and profiles, the ranking rule, the resolver, its
Plan, and the SwapFn it returns.
"""
