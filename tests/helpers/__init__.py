"""Helpers shared by test modules of more than one package (fixtures live in conftest.py files)."""
