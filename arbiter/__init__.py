"""The owner of the GPU's memory: the VRAM budget, where each model lives (resident, warm,
cold), which model to load or evict for which tier, and when batch work must yield. Decisions
are pure functions of the arbiter's state; one owner carries out their effects."""
