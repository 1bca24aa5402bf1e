"""BlockMover, the object an engine holds: built once, then per job it checks ids, builds
descriptors (or passes ids to the device), orders after ``after``, launches, and completes.
"""
