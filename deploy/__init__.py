"""Hosts and tools. Importing deploy/ adds the deployment tools' variables to the settings table."""
from deploy import deploy_settings  # noqa: F401  (extends common.settings' table)
