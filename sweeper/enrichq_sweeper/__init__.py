"""The sweeper: lease recovery, dead letters, retention and the refresh schedule (one leader)."""
