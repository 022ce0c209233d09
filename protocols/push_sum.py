"""Push-sum (Kempe, Dobra and Gehrke, 2003): averaging of one number, the README's example protocol.

Node i starts with (s_i, w_i) = (i, 1). Each round it keeps a share 1/(deg_i + 1) of
both and sends one share to every neighbour, then adds what arrived; s_i / w_i tends
to the mean of the initial values on a connected graph (sum s and sum w are conserved
while no message is lost).
"""
from dataclasses import dataclass, field

from emulator.protocol import Protocol, register

from .common import like


@dataclass
class PushSumOptions:
    timeout: float = field(default=5.0, metadata={"help": "emulated seconds to wait per round"})


@dataclass
class Carried:
    """What a node carries from round to round: its sum s_i and weight w_i."""
    s: float
    w: float


@register("push-sum")
class PushSum(Protocol):
    """Push-sum averaging of one number."""
    Options = PushSumOptions
    checkpointable = True

    async def run(self, node):
        state = node.carry(Carried(float(node.id), 1.0))
        async for _ in node.rounds():
            share = 1 / (len(node.neighbours) + 1)
            body = [state.s * share, state.w * share]
            node.broadcast("sw", body)
            s, w = body
            for msg in (await node.gather("sw", timeout=self.options.timeout, valid=like(body))).values():
                s, w = s + msg.body[0], w + msg.body[1]
            state.s, state.w = s, w
            node.log(estimate=s / w)
