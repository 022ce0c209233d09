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


@register("push-sum")
class PushSum(Protocol):
    """Push-sum averaging of one number."""
    Options = PushSumOptions

    async def run(self, node):
        s, w = float(node.id), 1.0
        async for _ in node.rounds():
            share = 1 / (len(node.neighbours) + 1)
            body = [s * share, w * share]
            node.broadcast("sw", body)
            s, w = body
            for msg in (await node.gather("sw", timeout=self.options.timeout, valid=like(body))).values():
                s, w = s + msg.body[0], w + msg.body[1]
            node.log(estimate=s / w)
