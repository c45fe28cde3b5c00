"""Agents: ordinary async programs that talk to the policy over many turns and call tools,
recorded token for token (see runner.py for the contract)."""
from asyncrl.agents.env import Environment, Step, env_agent
from asyncrl.agents.episode import EpisodeLimit
from asyncrl.agents.runner import AgentContext
from asyncrl.agents.tools import Tool, tool

__all__ = ["AgentContext", "Environment", "EpisodeLimit", "Step", "Tool", "env_agent", "tool"]
