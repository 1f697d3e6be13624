"""The afl-server process: start-up, pre-start check, status, ports, metrics and logs."""
