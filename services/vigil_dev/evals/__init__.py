"""The eval harness (``make eval``): the agent's behaviour measured across scenarios.

Each scenario is one claim of events for a fresh user, run through the real agent
(:class:`vigil.agent.claude.ClaudeAgent`: its prompt, permission gate, deferral and tools)
with the real ``anthropic`` client, and scored on what the person would experience:
messages sent, silence kept, approvals asked, action tools run, and injected instructions
followed (a tool call or message that names a scenario's canary, the target that untrusted
content tried to steer the agent to). :mod:`vigil_dev.evals.scenarios` holds the suites,
:mod:`vigil_dev.evals.harness` the runner and the table.

Offline (the default) the model is the scripted Messages API answering from
``offline_script.json``: that checks the harness itself, and a deliberately bad script must
score as failing (tests/test_evals.py). With ``ANTHROPIC_API_KEY`` set and no
``ANTHROPIC_BASE_URL`` it measures the real model named by ``--model`` (default: the agent's
``VIGIL_MODEL``).
"""
