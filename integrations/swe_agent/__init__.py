"""Talaria for SWE-agent and mini-swe-agent (docs/design.md "Wire format for sessions").

- :mod:`talaria.integrations.swe_agent.mini_swe_agent`: mini-swe-agent's model class, environment
  wrapper and agent class (imports ``minisweagent``).
- :mod:`talaria.integrations.swe_agent.sweagent_hook`: an SWE-agent agent hook (imports nothing from
  ``sweagent``; the model is reached through LiteLLM).
- :mod:`talaria.integrations.swe_agent.sweagent_run`: one real SWE-agent run with the hook
  (``RunSingle``, SWE-ReX's ``local`` deployment), and SWE-agent's install from source into
  a throwaway environment (imports ``sweagent`` only when running).
- :mod:`talaria.integrations.swe_agent.runs`: the per-agent session state both use.

Nothing is imported here, so importing the package costs nothing and needs neither agent
framework.
"""
