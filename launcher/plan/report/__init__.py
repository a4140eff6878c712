"""The plan shown to the user: its tables and its PNG chart."""
