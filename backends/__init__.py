"""In-tree backends. Each is a plugin registered through the ``kvswap.backends`` entry
point group, exactly as a vendor's package would be; core never imports one by name."""
