"""data cache stage."""
