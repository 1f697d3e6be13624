"""Images to features: site data readers, backbones, weights, extraction, shards, merge."""
