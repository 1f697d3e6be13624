"""The afl-client daemon: its loop, state, transport, RPCs, checks, hosts and the decryptor."""
