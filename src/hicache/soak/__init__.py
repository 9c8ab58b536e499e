"""``hicache soak``: random multi-client traffic through a real config, checking every promise as it goes."""
