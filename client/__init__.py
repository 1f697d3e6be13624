"""The hospital side: site data, feature extraction and the afl-client daemon."""
