"""tiergate's front door: HTTP (Starlette on uvicorn), API keys -> tiers, the admission gate,
OpenAI-shaped request schemas and errors, metrics, and the command line. It calls the arbiter
for a lease on a model and never touches model weights itself."""
