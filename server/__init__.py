"""The coordinator side: rounds, storage, release-plan enforcement, solve and the afl-server daemon."""
