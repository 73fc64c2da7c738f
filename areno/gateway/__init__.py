"""The agent gateway (--agent-path): agents written against the OpenAI API,
trained through an OpenAI-compatible endpoint served inside the run, with
token-exact trajectories (docs/DESIGN.md, "Agents through a gateway")."""
