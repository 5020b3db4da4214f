"""Multi-turn episodes: environments, the episode runner and built-in tools."""
