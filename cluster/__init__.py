"""Beyond one GPU: one arbiter per GPU as a Ray Serve replica, routed by a tier-aware router."""
