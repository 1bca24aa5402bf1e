"""The backend registry: the contract with backends (hooks, CopyImpl, Calibration), the plugin
manager that loads them, the platform they serve, and the host reference backend.
"""
