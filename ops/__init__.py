"""The operator's commands: CA and provisioning, admin, export, audit and log verification."""
