"""Where the ModernBertModel sits, and the HF call convention around the packed forward."""
