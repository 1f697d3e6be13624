"""A site's own policy: its check of a signed plan, its DP accounting, its lifetime ledger."""
