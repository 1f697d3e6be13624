"""`afl report`: self-contained HTML reports, their plots and text tables."""
