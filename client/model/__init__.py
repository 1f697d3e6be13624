"""The published model at a site: verify, evaluate, export, model card, predict."""
