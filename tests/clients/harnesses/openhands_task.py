"""Runs the OpenHands SDK agent (openhands-sdk + openhands-tools) on one task in the current
directory, its LLM pointed at graft the way `graft harness env openhands-sdk` says
(LLM_MODEL, LLM_BASE_URL, LLM_API_KEY; `LLM.load_from_env()`).

usage: python openhands_task.py TASK   (the python of the venv that has openhands-sdk)

The agent is the SDK's default one for the CLI (terminal, file editor, task tracker, plus
the built-in finish and think tools), in a local workspace: the current directory, no
Docker. It prints one JSON line: the number of events and the agent's final state.
"""

import json
import os
import sys

from openhands.sdk import LLM, Conversation
from openhands.tools.preset.default import get_default_agent


def main() -> None:
    task = sys.argv[1]
    llm = LLM.load_from_env()
    agent = get_default_agent(llm=llm, cli_mode=True)
    conversation = Conversation(agent=agent, workspace=os.getcwd(), visualizer=None)
    conversation.send_message(task)
    conversation.run()
    state = conversation.state
    print(
        json.dumps(
            {
                "client": "openhands-sdk",
                "events": len(state.events),
                "status": str(state.execution_status),
            }
        )
    )


if __name__ == "__main__":
    main()
