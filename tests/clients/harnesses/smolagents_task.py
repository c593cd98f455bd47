"""Runs a smolagents agent (ToolCallingAgent or CodeAgent) on one task in the current
directory, its model pointed at graft the way `graft harness env openai` says
(OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL; smolagents' OpenAIServerModel).

usage: python smolagents_task.py tool-calling|code TASK   (the python of the venv that has
smolagents[openai])

The agent has one tool of its own, `shell` (runs a command in the current directory and
returns its output). It prints one JSON line: the agent kind, its steps and its answer.
"""

import json
import os
import subprocess
import sys

from smolagents import CodeAgent, OpenAIServerModel, ToolCallingAgent, tool


@tool
def shell(command: str) -> str:
    """Runs a shell command in the current directory and returns its output.

    Args:
        command: the command line, run by /bin/sh.
    """
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def main() -> None:
    kind, task = sys.argv[1], sys.argv[2]
    model = OpenAIServerModel(
        model_id=os.environ["OPENAI_MODEL"],
        api_base=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
    )
    agent_class = {"tool-calling": ToolCallingAgent, "code": CodeAgent}[kind]
    agent = agent_class(tools=[shell], model=model, max_steps=4, verbosity_level=0)
    answer = agent.run(task)
    print(json.dumps({"client": f"smolagents-{kind}", "steps": len(agent.memory.steps), "answer": str(answer)}))


if __name__ == "__main__":
    main()
