"""The package's tables, read by every layer: one entry per architecture, per environment switch, per upstream pin."""
