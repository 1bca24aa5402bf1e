"""From block ids to addresses: descriptor arrays and their one check, where a block lives in
a tensor (regions), and a block's bytes as contiguous runs.
"""
