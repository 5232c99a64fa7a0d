"""Operating a running server: the admin client and the ops commands."""
