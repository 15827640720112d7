"""Word lists for the RULER generators (written for this project; no list is copied from another package).

* NIAH keys of type ``words`` are adjective-noun pairs (``"amber-lantern"``), as in RULER, whose keys are
  adjective-noun pairs too; :data:`ADJECTIVES` x :data:`NOUNS` gives about 85,000 of them.
* Common-words extraction (``cwe``) draws single words from :func:`cwe_word_pool`: the words below plus the frequent
  plain English words of the standard-library documentation (the essay haystack, see
  :func:`eval_harness.needle.haystack_text`); only when a very long context needs more distinct words than that are
  adjective-noun pairs appended.
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter

ADJECTIVES: tuple[str, ...] = tuple(
    """
    able absent acid agile alert amber ample ancient angry arctic arid ashen autumn avid awake azure bald bare
    bashful bitter bleak blind blond blue blunt bold bony brave brief bright brisk broad bronze brown busy calm
    candid careful cheap cheerful chilly civic clean clear clever cloudy clumsy coarse cold cosmic costly cozy crisp
    crude cruel curly curved cyan damp dapper dark dear deep dense dizzy dry dull dusty eager early earnest easy
    elder empty equal exact faint fair false famous fancy fast feral fierce fine firm flat fluffy fond formal frail
    frank free fresh frosty frozen full gentle giant giddy glad gloomy glossy golden grand grassy gray great green
    grim gruff hairy happy hardy harsh hasty heavy hidden hollow honest humble hungry icy idle inner ivory jolly
    jovial juicy keen kind lanky large late lavish lazy lean level light limber linen liquid little lively lofty
    lonely loud loyal lucky lunar mellow merry mighty mild misty modern modest moist molten muddy murky narrow nasty
    native neat nimble noble noisy normal odd olive open orange ornate pale patient plain plump polar polite poor
    proud pure purple quaint quick quiet rapid rare ready regal rigid ripe rocky rosy rough round royal ruby rural
    rusty sacred salty sandy scarlet secret serene shaggy shallow sharp shiny short shy silent silky silver simple
    sleek sleepy slim slow small smoky smooth snowy soft solar solid sour spare spicy steady steep stern sticky
    stormy stout strict sturdy subtle sunny super sweet swift tall tame tender tense thick thin tidy tiny tired
    tough tranquil tropical true twin upper urban vague vast velvet violet vivid wary warm weary wet white wide wild
    windy wise witty wooden woolly yellow young zany zealous
    """.split()
)

NOUNS: tuple[str, ...] = tuple(
    """
    acorn actor album alley anchor ant anvil apple apron arch arrow atlas attic aunt badge bagel bakery ballad
    balloon bamboo banana banjo barn barrel basket beacon beaver bell bench berry bicycle bison blanket blossom
    boat bonnet boulder bowl bracelet branch bread brick bridge brook broom bucket buffalo bugle bunny butter
    button cabin cable cactus camel camera canal candle canoe canyon captain carpet carrot castle cat cedar cellar
    chair chalk cherry chess chimney cider circus citadel clock cloud clover coast cobra coconut comet compass
    cookie copper coral cottage cotton cougar crab crane crayon creek cricket crown crystal cup curtain cushion
    daisy dancer desert diamond dolphin donkey dragon drum eagle easel elbow elephant ember engine falcon feather
    fence fern ferry fiddle fig finch flag flute forest fossil fountain fox garden garlic gate gazelle geyser ginger
    glacier glove goat goose grape guitar hammer harbor harp hat hawk hazel hedge helmet heron hill honey hornet
    horse hut iceberg igloo island ivy jacket jaguar jar jelly jewel kettle key kite kitten ladder lagoon lake lamp
    lantern lemon leopard lettuce lily lion lizard llama lobster locket lotus magnet mango maple marble meadow melon
    mirror mitten monkey moose moth mountain mug mushroom needle nest nickel oak oar ocean octopus olive onion orbit
    orchard otter owl oyster paddle palace panda parrot peach peanut pearl pebble pelican pencil pepper piano
    pigeon pillow pine planet plum pond poppy potato puffin pumpkin puppet quartz quill rabbit raccoon radish
    rainbow raven reef ribbon river robin rocket saddle salmon satchel scarf scroll shell shovel silo skate sled
    slipper snail sparrow spider sponge spoon squirrel stable statue stone stream sunflower swan sweater table
    teapot temple thimble thistle tiger timber toad tomato torch tower tractor trumpet tulip tunnel turtle umbrella
    valley vase violin volcano wagon walnut walrus wand whale wheat whistle willow window wizard wolf yacht zebra
    """.split()
)

VERBS: tuple[str, ...] = tuple(
    """
    adapt admire advise allow amuse answer argue arrange arrive bake balance bathe beg behave blink boast boil
    borrow bounce breathe brush build calculate carry chase cheer chew clap climb collect comb compare complain
    cough count crawl cross dance decide deliver design dig divide doubt drift earn educate embrace enjoy escape
    examine explain fasten fetch float fold follow gather glow grab greet grow guard guess hammer hover hug hum
    hurry imagine improve invent invite jog juggle jump kneel knit knock laugh launch learn listen march mend mix
    mumble nod notice obey offer open order paint paddle pause plant play polish pour pray pretend protect pull
    punch push question race reach read relax remember repair repeat rescue rest return rhyme ride roar roll rush
    sail scatter scold scrub search settle shiver shout sing sketch skip sleep slide smile sneeze sniff sort
    sparkle spell spill splash spray squeeze stare stir stretch stroll study swim switch talk taste teach thank
    tickle travel trust tumble twist unlock vanish visit wade wait wander wash watch wave weave whisper whistle
    wiggle wink wobble wonder worry wrap write yawn yell zoom
    """.split()
)

#: Words too generic or too code-like to serve as "common words" (they occur in the templates or are keywords).
_EXCLUDE = frozenset(
    "answer question words word list most common above appear often memorize numbered below others true false none "
    "self args kwargs return returns".split()
)


@functools.lru_cache(maxsize=1)
def key_words() -> tuple[str, ...]:
    """Every adjective-noun key, in a fixed order."""
    return tuple(f"{a}-{n}" for a in ADJECTIVES for n in NOUNS)


@functools.lru_cache(maxsize=1)
def cwe_word_pool() -> tuple[str, ...]:
    """Single words for common-words extraction, then adjective-noun pairs (fixed order, no duplicates).

    The single words are :data:`ADJECTIVES`, :data:`NOUNS` and :data:`VERBS`, and the lower-case alphabetic words of
    4 to 10 letters (with a vowel) that occur at least twice in the standard-library documentation haystack.
    """
    from ..needle import haystack_text  # imported lazily: building the haystack takes a fraction of a second

    counts = Counter(re.findall(r"(?<![\w.])[a-z]{4,10}(?![\w.])", haystack_text()))
    docs = {w for w, c in counts.items() if c >= 2 and re.search("[aeiouy]", w)}
    singles = set(ADJECTIVES) | set(NOUNS) | set(VERBS) | docs
    singles -= _EXCLUDE
    ordered = sorted(singles)
    pairs = list(key_words())
    random.Random("cwe-pairs").shuffle(pairs)
    return tuple(ordered + pairs)
