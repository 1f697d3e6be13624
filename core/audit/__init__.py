"""Audits over what the federation has released (the differencing audit over a whole history)."""
