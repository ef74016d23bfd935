"""KV tiers: prefix blocks kept outside the pool (disk, remote), so they outlive evictions and restarts."""
